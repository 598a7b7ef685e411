"""graphddp: data-parallel gradient all-reduces planned ahead of time inside torch.compile."""
from graphddp.api import GraphDDP, compile
from graphddp.config import DDPConfig
from graphddp.schedule import Bucket, Schedule
from graphddp.verify import VerificationError, verify

__all__ = ["Bucket", "DDPConfig", "GraphDDP", "Schedule", "VerificationError", "compile", "verify"]
__version__ = "0.1.0"
