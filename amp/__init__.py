"""Mixed-precision helpers: loss scalers that keep fp16 gradients from underflowing (``loss_scaler``)."""

from .loss_scaler import DynamicLossScaler, LossScaler

__all__ = ["DynamicLossScaler", "LossScaler"]
