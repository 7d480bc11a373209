"""Training: validate a config into a Plan (``plan``), the loop (``train``), the jitted step
(``train_step``), the optimizer, the input pipeline, fine-tuning and initialisation from
pretrained weights, and reading a trained run back."""
