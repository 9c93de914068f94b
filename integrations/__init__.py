"""Adapters that put logitproc's processing inside other libraries' generation loops (``integrations.transformers``:
Hugging Face ``generate()``); each imports its library only when it is itself imported."""
