"""The generation engine. Rank 0 schedules, broadcasts each step, runs the model, samples;
the other ranks run the model on what rank 0 sends (``run_worker``).

Every step's ForwardBatch travels as one int64 array, ``[command, *batch.to_array()]``,
through the backend's ``broadcast_int64`` on the global group. All ranks then take part in
the same forward (its all-reduces and the logits all-gather); only rank 0 looks at the
logits. While idle, rank 0 sends a no-op now and then so the waiting ranks never sit in one
collective long enough to hit the process group's timeout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from glm_fused.batch import ForwardBatch
from glm_fused.engine.sampling import InvalidParam, SamplingParams, sample
from glm_fused.engine.scheduler import Scheduler
from glm_fused.engine_args import EngineArgs
from glm_fused.engine.sequence import Sequence
from glm_fused.tokenizer import IncrementalDecoder

CMD_STOP, CMD_FORWARD, CMD_NOOP = 0, 1, 2


@dataclass
class RequestOutput:
    """What one step did for one request (its new token, text delta, and whether it ended)."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    seq: Sequence  # read-only view for timings and full results


class LLMEngine:
    """Continuous-batching engine over a ModelRunner (``forward(ForwardBatch) -> logits``).

    Not thread-safe: one thread calls ``add_request`` / ``abort`` / ``step``. The server
    feeds it through a queue; ``generate`` drives it offline.
    """

    def __init__(self, runner, args: EngineArgs, *, vocab_size: int | None = None,
                 eos_token_ids: Iterable[int] = (), tokenizer=None,
                 broadcast: Callable[[np.ndarray], object] | None = None,
                 heartbeat_s: float = 2.0):
        self.runner = runner
        self.scheduler = Scheduler(args)
        self.max_model_len = args.max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.tokenizer = tokenizer  # glm_fused.tokenizer.Tokenizer (or anything with decode): text output
        self.broadcast = broadcast
        self.heartbeat_s = heartbeat_s
        self.seqs: dict[str, Sequence] = {}
        self._last_broadcast = time.monotonic()
        self._stopped = False
        # Running totals (read by the server's /metrics).
        self.num_steps = 0
        self.num_forward_tokens = 0
        self.forward_seconds = 0.0
        self.fusion_totals: dict[str, int] = {}

    # ---- requests ------------------------------------------------------------------------
    def check_prompt(self, prompt_token_ids: list[int], params: SamplingParams,
                     param: str = "prompt", max_tokens_given: bool = True) -> None:
        """Raise InvalidParam when a request cannot fit; ``param`` names the prompt field."""
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidParam(param, f"{param} is empty")
        if self.vocab_size is not None:
            bad = [t for t in prompt_token_ids if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise InvalidParam(param, f"{param} has token id {bad[0]} outside the vocabulary "
                                          f"(0..{self.vocab_size - 1})")
        if n >= self.max_model_len:
            raise InvalidParam(param, f"{param} has {n} tokens; this server's context limit "
                                      f"(--max-model-len) is {self.max_model_len}, leaving no room to generate",
                               code="context_length_exceeded")
        if max_tokens_given and n + params.max_tokens > self.max_model_len:
            raise InvalidParam("max_tokens", f"max_tokens={params.max_tokens} plus the {n} prompt tokens "
                                             f"exceeds the context limit of {self.max_model_len} tokens",
                               code="context_length_exceeded")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> Sequence:
        if request_id in self.seqs:
            raise ValueError(f"duplicate request id {request_id!r}")
        self.check_prompt(prompt_token_ids, params)
        detok = IncrementalDecoder(self.tokenizer) if self.tokenizer is not None else None
        seq = Sequence(request_id, prompt_token_ids, params, detokenizer=detok, arrival_time=arrival_time)
        self.scheduler.add(seq)
        self.seqs[request_id] = seq
        return seq

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """Drop a request (client gone, shutdown); its KV-cache blocks are free for the next step."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, reason)
        return self._output(seq, [])

    def abort_all(self, reason: str = "abort") -> list[RequestOutput]:
        return [out for rid in list(self.seqs) if (out := self.abort(rid, reason)) is not None]

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def kv_cache_stats(self) -> dict:
        """The KV cache in plain numbers: ``num_blocks``, ``block_size``, ``usage`` (fraction of
        blocks held by sequences), ``prefix_caching`` (on/off), ``prefix_cache_queries`` and
        ``prefix_cache_hits`` (tokens looked up / found cached, running totals),
        ``num_preemptions`` (running total). Safe to read from another thread."""
        return self.scheduler.kv_cache_stats()

    # ---- one step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        step = self.scheduler.schedule()
        if step is None:
            return []
        self._send(CMD_FORWARD, step.batch.to_array())
        start = time.perf_counter()
        logits = self.runner.forward(step.batch)
        self.forward_seconds += time.perf_counter() - start
        self.num_steps += 1
        self.num_forward_tokens += step.num_tokens
        self._add_fusion_stats()
        self.scheduler.commit(step)

        outputs, row = [], 0
        now = time.monotonic()
        for seq, wants_sample in zip(step.seqs, step.sample):
            if not wants_sample:
                continue
            token = sample(logits[row], seq.params, seq.rng)
            row += 1
            seq.append_token(token, self.eos_token_ids, self.max_model_len, now=now)
            if seq.finish_reason is not None:
                self.scheduler.finish(seq, seq.finish_reason)
                self.seqs.pop(seq.request_id, None)
            outputs.append(self._output(seq, [token]))
        return outputs

    def _output(self, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        return RequestOutput(seq.request_id, new_tokens, seq.take_text_delta(), seq.finished,
                             seq.finish_reason if seq.finished else None, seq.prompt_len,
                             len(seq.output_token_ids), seq)

    def _add_fusion_stats(self) -> None:
        stats_fn = getattr(self.runner, "fusion_stats", None)
        if stats_fn is None:
            return
        for key, value in (stats_fn() or {}).items():
            if isinstance(value, dict):
                for sub, n in value.items():
                    name = f"{key}:{sub}"
                    self.fusion_totals[name] = self.fusion_totals.get(name, 0) + int(n)
            elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
                self.fusion_totals[key] = self.fusion_totals.get(key, 0) + int(value)

    # ---- the other ranks -----------------------------------------------------------------
    def _send(self, cmd: int, payload: np.ndarray | None = None) -> None:
        if self.broadcast is None:
            return
        head = np.array([cmd], dtype=np.int64)
        self.broadcast(head if payload is None else np.concatenate([head, payload]))
        self._last_broadcast = time.monotonic()

    def heartbeat(self) -> None:
        """Call while idle: keeps the waiting ranks' broadcast from timing out."""
        if self.broadcast is not None and time.monotonic() - self._last_broadcast >= self.heartbeat_s:
            self._send(CMD_NOOP)

    def stop_workers(self) -> None:
        """Tell the other ranks to leave ``run_worker`` (once)."""
        if not self._stopped:
            self._stopped = True
            self._send(CMD_STOP)

    # ---- offline -------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 on_output: Callable[[RequestOutput], None] | None = None) -> list[Sequence]:
        """Run prompts to completion through the same scheduler the server uses."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        seqs = [self.add_request(f"offline-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params_list))]
        while self.has_unfinished():
            for out in self.step():
                if on_output is not None:
                    on_output(out)
        return seqs


def run_worker(runner, broadcast_int64) -> int:
    """Loop of every rank but 0: run each forward rank 0 announces, until it says stop.

    Returns the number of forwards run.
    """
    steps = 0
    while True:
        msg = broadcast_int64(None, src=0)
        cmd = int(msg[0])
        if cmd == CMD_STOP:
            return steps
        if cmd == CMD_FORWARD:
            runner.forward(ForwardBatch.from_array(msg[1:]))
            steps += 1
        elif cmd != CMD_NOOP:
            raise RuntimeError(f"rank 0 sent an unknown command {cmd}")
