"""glm_fused: GLM-4.5-Air for tensor-parallel inference with fused all-reduce + RMSNorm."""

__version__ = "0.1.0"
