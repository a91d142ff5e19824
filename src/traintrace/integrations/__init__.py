"""Framework integrations, each behind its own extra.

* :mod:`traintrace.integrations.lightning`: ``TraintraceCallback`` for
  PyTorch Lightning (``pip install 'traintrace[lightning]'``).
* :mod:`traintrace.integrations.transformers`: ``TraintraceTrainerCallback``
  for the Hugging Face ``Trainer`` (``pip install 'traintrace[transformers]'``).

Nothing here is imported by ``import traintrace``.
"""
