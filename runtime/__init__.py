"""The runtime: devices, paired host/device buffers, the logit processor and the sampler."""
