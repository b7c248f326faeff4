"""Models built on the resources: the streaming TTS model and Gemma 3, each with its entry in the
registry a deployment names models through (`mstar_jax.registry`), and the layers they share."""
