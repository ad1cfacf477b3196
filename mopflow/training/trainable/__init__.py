"""The one trainable unit: its state, batches, schedule and Lightning module."""
