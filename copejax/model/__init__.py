"""The model: the decoder (``transformer``), the one place where schemes meet attention
(``attention``, ``attention_paths``, ``ring_decode``), its frozen config (``config``, ``checks``,
``layouts``, ``saved_configs``) and incremental decoding (``decode``)."""
