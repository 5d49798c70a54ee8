"""Framework-free generation engine: sequences, continuous-batching scheduler, sampler."""

from glm_fused.engine.llm_engine import LLMEngine, RequestOutput, run_worker
from glm_fused.engine.sampling import InvalidParam, SamplingParams, sample
from glm_fused.engine.scheduler import Scheduler
from glm_fused.engine.sequence import Sequence, Status

__all__ = ["LLMEngine", "RequestOutput", "run_worker", "InvalidParam", "SamplingParams", "sample",
           "Scheduler", "Sequence", "Status"]
