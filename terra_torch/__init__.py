"""terra_torch: imperative-symbolic co-execution for PyTorch.

Keep writing an ordinary imperative training loop; terra_torch records the aten ops it runs,
builds a symbolic graph that covers every path it saw, and runs that graph on a C++ worker
while Python runs ahead. See README.md and docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import torch

from terra_torch import _torch_gate

_torch_gate.check(torch.__version__)

from terra_torch import _C  # noqa: E402  (needs the gate first)

_C.check_torch_abi(torch.__version__)
_C.install_interceptor()

from terra_torch import _backward, _data_loading, _legacy_constructors, _log, _materialize, _optimizer, _rng, debug, profile  # noqa: E402
from terra_torch._data_loading import outside_program  # noqa: E402
from terra_torch.api import explain, function, stats, synchronize, timeline, unwrap, wrap  # noqa: E402

_log.configure()  # TERRA_LOG=debug|info|warning

profile.enable_from_env()  # TERRA_PROFILE_RECORD=path: warns (never raises) when it cannot apply
_materialize.install()  # numpy()/tolist() of a placeholder wait for its value
_legacy_constructors.install()  # Tensor.new / new_tensor on a placeholder
_backward.install()  # backward() in co-execution: replayed without the engine where it can be
_optimizer.install()  # optimizers' step() in co-execution: replayed without their Python where they can be
_rng.install()  # torch.manual_seed / get_rng_state / set_rng_state wait for the graph's draws
_data_loading.install()  # a DataLoader's batches are assembled outside the program, eagerly

__version__ = "0.1.0"

__all__ = ["wrap", "unwrap", "function", "synchronize", "stats", "explain", "timeline", "outside_program", "debug",
           "profile", "__version__"]
