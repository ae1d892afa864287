"""Generation backends behind one interface: HF ``generate`` (``hf``) and vLLM (``vllm_backend``)."""
