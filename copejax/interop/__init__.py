"""Interoperability: Hugging Face Llama configs and tensors in and out (``hf_config``,
``hf_weights``) and the ``convert`` program."""
