"""The tiny model and quiet run options that the tests' ``agentrl train`` / ``agentrl sft`` runs share.

``QUIET`` leaves out the work of a run that no test reads unless it asks for it: the HF export of the last
checkpoint (the whole model again, in safetensors) and the TensorBoard events. A test that checks one of them
passes the key again after these (``trainer.export_hf=true``): the later ``key=value`` wins.
``TINY`` is the one-layer random tiny GPT-OSS with ``QUIET``.
"""

QUIET = ["trainer.export_hf=false", "trainer.tensorboard=false"]
TINY = ["model=tiny-gpt-oss", "model_kwargs.num_layers=1", *QUIET]
