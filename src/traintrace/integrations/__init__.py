"""Framework integrations, each behind its own extra.

* :mod:`traintrace.integrations.lightning`: ``TraintraceCallback`` for
  PyTorch Lightning (``pip install 'traintrace[lightning]'``).
* :mod:`traintrace.integrations.transformers`: ``TraintraceTrainerCallback``
  for the Hugging Face ``Trainer`` (``pip install 'traintrace[transformers]'``).
* :mod:`traintrace.integrations.torchelastic`: ``install_torchelastic_bridge``,
  torchelastic's events and metrics in the launcher's agent stream
  (``pip install 'traintrace[torch]'``; ``traintrace-run`` installs it).

Nothing here is imported by ``import traintrace``.
"""
