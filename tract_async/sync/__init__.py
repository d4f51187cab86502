"""Global lock without atomics (two tiers), the lock-manager coroutine and its election."""
from .liveness import heartbeat_forever
from .lock import GlobalLock, LockStatistics, PollPolicy
from .manager import LockManager, ManagerInfo, ManagerPolicy, ManagerStatistics, read_manager
from .manager_thread import ManagerThread

__all__ = ["GlobalLock", "LockManager", "LockStatistics", "ManagerInfo", "ManagerPolicy",
           "ManagerStatistics", "ManagerThread", "PollPolicy", "heartbeat_forever", "read_manager"]
