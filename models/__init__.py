"""Decision models: training, evaluation, TorchScript export (see the training issue)."""
