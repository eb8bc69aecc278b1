"""What every DeepSpeed worker would import or probe on its own at its engine's construction, done
once in the fork server that ``ds-resilience run --preload`` forks the workers from.

Building the engine imports ``torch._dynamo`` (``torch.optim``'s first optimizer: about 9 s of one
core on this project's 2-core CI machine) and ``torch.distributed.fsdp`` (3 s), and DeepSpeed probes
which of its ops compile here (``deepspeed.ops.__compatible_ops__``: a C compiler run, 1 s), and
loading a CPU op (DeepSpeed's default ``FusedAdam``) asks py-cpuinfo twice (a subprocess each, about
3.5 s, kept on disk since: ``runtime/cpu_probe.py``), and the config imports the expert-parallel
module. A worker forked from a server that did all of these starts training in a fraction of that.
Not here: DeepSpeed's Muon optimizer, which its own engine imports to check a ZeRO optimizer (its
``torch.compile`` decorators import inductor: 1.2 s alone, about 6 s of a core under load). Our
engines never run that check, so a server that runs them would pay it for nothing; preload
``deepspeed.runtime.zero.muon.muon_optimizer`` too for vanilla DeepSpeed ZeRO jobs (the test
harness does). Nothing here starts a thread or touches a GPU. Use: ``--preload torch,deepspeed,ds_resilience.integrations.warm``.
"""

from __future__ import annotations

import torch._dynamo  # noqa: F401
import torch.distributed.fsdp  # noqa: F401
import deepspeed.module_inject.auto_ep_config  # noqa: F401
import deepspeed.ops

deepspeed.ops.__compatible_ops__  # noqa: B018 - probed once, cached in the module

from ds_resilience.runtime.cpu_probe import memoize_cpu_info  # noqa: E402

memoize_cpu_info(warm=True)  # the answer, inherited by every forked worker
