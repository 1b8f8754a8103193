"""The remote backend: a Generator over `tandem rollout` servers (generator.py), the client that
reaches them (client.py) and the batching of one tick's calls into one request per server (batch.py)."""

from tandemrl.generation.remote.client import RolloutClient, ServerError
from tandemrl.generation.remote.generator import RemoteGenerator

__all__ = ["RemoteGenerator", "RolloutClient", "ServerError"]
