"""The training loop, batches and reporting."""
