"""What a training loop needs beyond the model and the optimizer: signals that stop a run cleanly, evaluation."""
