"""The frameworks fastst hands tensors to and takes them from: their one registry
(``registry``), the adapters of torch (``torch``, with ``cuda``, the ring into a GPU)
and JAX (``jax``), and the specs a writer takes from any framework's tensors
(``specs``). Each framework is imported on first use."""
