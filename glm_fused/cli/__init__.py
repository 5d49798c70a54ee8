"""Entry points behind scripts/*.py: each module has main(argv) and, when it runs on
several ranks, worker(args) for glm_fused.launcher."""
