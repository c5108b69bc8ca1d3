"""Mixed-precision helpers: loss scalers that keep fp16 gradients from underflowing."""

from amp.loss_scaler import DynamicLossScaler, LossScaler

__all__ = ["DynamicLossScaler", "LossScaler"]
