"""Framework tests: dtgen/ and kernels/ with no model folder, and the framework across models
(the registry, declared split points, the docs' tiny-model walkthrough, import boundaries, reports)."""
