"""HunyuanImage-3.0: the model, its examples and server, its golden parity, and the framework
features tested through it (plans, topologies, compile, distributed ranks, multi-GPU jobs)."""
