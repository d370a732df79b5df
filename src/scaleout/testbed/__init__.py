"""The emulated-cluster testbed: hosts as network namespaces on a shaped switch.

Bring a cluster up from Python (owned by the ``with`` block)::

    from scaleout.testbed import Testbed, TestbedConfig

    with Testbed(TestbedConfig(hosts=2, rate="1gbit", delay="50us")) as tb:
        for host in tb.hosts:
            argv = host.command([sys.executable, "train.py"])  # ip netns exec ...
            env = {**os.environ, **host.env(master_port=tb.free_port())}

or from the shell (``scaleout testbed up --hosts 2 --rate 1gbit``) and attach to it
with :meth:`Testbed.attach`. See ``docs/testbed.md``.
"""

from scaleout.testbed.config import DEFAULT_NAME, TestbedConfig
from scaleout.testbed.errors import TestbedError, TestbedUnavailable
from scaleout.testbed.host import HostInfo
from scaleout.testbed.launch import attach_wrapper
from scaleout.testbed.state import TestbedState, state_dir
from scaleout.testbed.system import check_capabilities
from scaleout.testbed.testbed import Testbed, list_testbeds, remove_stale

__all__ = [
    "DEFAULT_NAME",
    "HostInfo",
    "Testbed",
    "TestbedConfig",
    "TestbedError",
    "TestbedState",
    "TestbedUnavailable",
    "attach_wrapper",
    "check_capabilities",
    "list_testbeds",
    "remove_stale",
    "state_dir",
]
