"""Large-batch optimizers with layer-wise (per-tensor) adaptive learning rates.

* :class:`LARS` -- SGD with momentum, each tensor's step scaled by
  ``trust_coefficient * ||w|| / (||g|| + weight_decay * ||w||)`` (You, Gitman &
  Ginsburg 2017, arXiv:1708.03888).
* :class:`LAMB` -- Adam whose update ``u`` is scaled by ``||w|| / ||u||``
  (You et al. 2019, arXiv:1904.00962).

Both leave biases and norm weights (tensors with ``ndim <= 1``) out of the
adaptation and the weight decay by default; ``exclude=`` changes that::

    opt = dtrain.optim.LAMB(model.parameters(), lr=1e-3)                 # ndim <= 1 excluded
    opt = dtrain.optim.LAMB(model.parameters(), lr=1e-3, exclude=False)  # nothing excluded
    opt = dtrain.optim.LARS(model.parameters(), lr=1.0, exclude=lambda p: p.ndim == 1 or p.numel() < 64)
"""

from dtrain.optim.lamb import LAMB
from dtrain.optim.lars import LARS

__all__ = ["LARS", "LAMB"]
