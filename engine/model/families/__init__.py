"""One module per model family (its network, on the shared decoder of base.py and the
shared loader of loading.py), each with a torch-free declaration beside it (<name>_arch.py:
its architectures and how its shape reads); engine.model.registry lists those."""
