"""Data-parallel ranks placed by Ray (``data_parallel_backend="ray"``): remote ranks the front end starts itself.

Each rank gets a placement group of one bundle on the user's Ray cluster (the CPUs of its whole tensor-parallel
group, and a GPU per model rank on CUDA) — the
one this process is connected to (``ray.init()`` or ``ray.init(address=...)`` before the engine starts), else a
local one the engine starts and shuts down with itself. In that bundle an actor (``runtime/ray_rank.py``) runs
the remote rank's join path: it connects to the front end's watch socket with the CURVE keys it was handed,
receives its ``EngineProcArgs`` and runs the engine over the same ZeroMQ sockets a remote rank uses. So a
``RayRank`` is a ``RemoteRank`` (its liveness is the watch connection: a killed actor, a lost node) that also
owns its actor and placement group, and removes both when it stops. Under ``tensor_parallel_size=N`` the actor's
engine starts its N-1 tensor-parallel workers as its own children, as a local engine process does: on the bundle's
node, on its CPUs, and on CUDA on the N GPUs Ray made visible to the actor (model rank t on ``cuda:t``: the rule of
``rank_device`` for a process that sees exactly its rank's devices).
"""

# Ray is optional (the `ray` extra): where it is not installed, its imports are not errors.
# pyright: reportMissingImports=false

from __future__ import annotations

import contextlib
import logging
from typing import Any

import msgspec

from enginekit.client.remote import RemoteRank
from enginekit.config import EngineConfig
from enginekit.errors import EngineStartupError
from enginekit.runtime.launcher import engine_environ
from enginekit.runtime.ray_rank import RayRankActor
from enginekit.wire.messages import EngineProcArgs, RemoteRankKeys

logger = logging.getLogger("enginekit.client")

INSTALL_HINT = "data_parallel_backend='ray' needs Ray: pip install 'enginekit[ray]'"
LOOPBACK = "127.0.0.1"


def import_ray() -> Any:
    try:
        import ray
    except ImportError as error:
        raise ImportError(INSTALL_HINT) from error
    return ray


class RayCluster:
    """The Ray cluster a front end places its ranks on; a local one it started is shut down by ``close``."""

    def __init__(self, config: EngineConfig) -> None:
        self.ray = import_ray()
        self.config = config
        self.started = False
        if not self.ray.is_initialized():
            # NOTE: ray.init() joins the cluster RAY_ADDRESS names, if any, else starts a local one.
            try:
                self.ray.init(log_to_driver=config.log_level != "warning")
            except Exception as error:
                with contextlib.suppress(Exception):
                    self.ray.shutdown()
                raise EngineStartupError(
                    f"data_parallel_backend='ray': Ray did not start: {error} (a busy machine can make a new "
                    "local cluster miss Ray's own startup deadlines; connect to a running one with "
                    "ray.init(address=...) before the engine starts)",
                    phase="ray cluster",
                ) from error
            self.started = True
        try:
            self.gpu = self._wants_gpu()
            self.check_room()
            self.front_end_host = self._front_end_host()
        except BaseException:
            self.close()
            raise

    def _wants_gpu(self) -> bool:
        device = self.config.device
        if device is None:
            wanted = self.config.data_parallel_size * self.config.tensor_parallel_size
            return self.ray.cluster_resources().get("GPU", 0) >= wanted
        return device == "cuda"

    def check_room(self) -> None:
        """Refuse at once ranks whose bundles the cluster can never hold, as ``check_placement`` refuses more local
        ranks than cores: every rank's bundle together within the cluster's resources, and each bundle within one
        node's (a placement group's bundle is never split between nodes). Otherwise its placement group would wait
        out ``startup_timeout``. A cluster that has the room but lends it to others now is still waited for."""
        bundle = self.bundle()
        ranks = self.config.data_parallel_size
        size = self.config.tensor_parallel_size
        total = self.ray.cluster_resources()
        nodes = [node.get("Resources", {}) for node in self.ray.nodes() if node.get("Alive")]
        short = [
            f"{_amount(amount * ranks)} {name}s, the cluster has {_amount(total.get(name, 0))}"
            for name, amount in bundle.items()
            if amount * ranks > total.get(name, 0)
        ]
        fits_a_node = any(
            all(node.get(name, 0) >= amount for name, amount in bundle.items()) for node in nodes
        )
        if not short and fits_a_node:
            return
        what = f"{ranks} rank{'s' if ranks > 1 else ''}" + (
            f" of tensor_parallel_size={size}" if size > 1 else ""
        )
        per_rank = f"a bundle of {_describe_bundle(bundle)} per rank"
        if size > 1:
            per_rank += f": {size} model ranks x {self.threads_per_model_rank()} CPU each"
        if short:
            problem = f"need {'; '.join(short)}"
        else:
            largest = max(nodes, key=lambda node: node.get("CPU", 0), default={})
            problem = (
                "need each bundle on one node, and no node has that much "
                f"(the largest: {_describe_bundle({name: largest.get(name, 0) for name in bundle})})"
            )
        raise ValueError(
            f"data_parallel_backend='ray': {what} ({per_rank}) {problem}; give Ray more (ray.init(num_cpus=...) "
            "before the engine starts, or more nodes), or ask for less: fewer ranks, a smaller "
            "tensor_parallel_size or num_threads"
        )

    def _front_end_host(self) -> str:
        """Where the ranks reach this front end: the host of ``address``, else loopback on a one-node
        cluster, else this node's address."""
        if self.config.address is not None:
            return self.config.address.removeprefix("tcp://").rpartition(":")[0] or LOOPBACK
        alive = [node for node in self.ray.nodes() if node.get("Alive")]
        return LOOPBACK if len(alive) <= 1 else self.ray.util.get_node_ip_address()

    def threads_per_model_rank(self) -> int:
        """The torch threads of each model rank: ``num_threads`` (1 if unset) shared out between the
        ``tensor_parallel_size`` model ranks, as a local engine shares its threads, at least one each."""
        return max(1, (self.config.num_threads or 1) // self.config.tensor_parallel_size)

    def bundle(self) -> dict[str, float]:
        """One rank's resources, its whole tensor-parallel group's: a CPU per thread of each model rank, and on CUDA
        a GPU per model rank."""
        size = self.config.tensor_parallel_size
        bundle: dict[str, float] = {"CPU": float(size * self.threads_per_model_rank())}
        if self.gpu:
            bundle["GPU"] = float(size)
        return bundle

    def close(self) -> None:
        if self.started:
            self.started = False
            with contextlib.suppress(Exception):
                self.ray.shutdown()


def _amount(value: float) -> str:
    return f"{value:g}"


def _describe_bundle(bundle: dict[str, float]) -> str:
    return ", ".join(f"{_amount(amount)} {name}" for name, amount in bundle.items())


class RayRank(RemoteRank):
    """A rank in a Ray actor: watched like a remote rank; it owns the actor and its placement group."""

    def __init__(self, rank: int, cluster: RayCluster, keys: RemoteRankKeys) -> None:
        super().__init__(rank, "")
        self.cluster = cluster
        self.keys = keys
        self.phase = "placement (a Ray placement group for the rank)"
        self.group: Any = None
        self.actor: Any = None
        self.serving: Any = None  # the actor's serve() call: done when the actor ended or died

    def start(self, args: EngineProcArgs) -> None:
        super().start(args)
        ray = self.cluster.ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.cluster.bundle()
        self.group = placement_group([bundle], strategy="PACK")
        timeout = args.config.startup_timeout
        ready, _ = ray.wait([self.group.ready()], timeout=timeout)
        if not ready:
            raise EngineStartupError(
                f"engine rank {self.rank}: the Ray cluster found no room for its bundle {bundle} within "
                f"startup_timeout={timeout}s (available: {ray.available_resources()})",
                phase=self.phase,
            )
        self.phase = "join (a Ray actor joining the front end)"
        # NOTE: the OpenMP defaults a local engine gets must be set before torch loads in the worker.
        environ = engine_environ({})
        actor_class = ray.remote(RayRankActor)
        self.actor = actor_class.options(
            num_cpus=bundle["CPU"],
            num_gpus=bundle.get("GPU", 0),
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=0),
            runtime_env={"env_vars": environ},
        ).remote(self.rank)
        # NOTE: the engine's threads, which its tensor-parallel executor shares out between the model ranks.
        threads = int(bundle["CPU"])
        self.serving = self.actor.serve.remote(msgspec.json.encode(self.keys), threads, args.config.log_level)

    def is_alive(self) -> bool:
        if super().is_alive() and not self.joined and self.serving is not None:
            done, _ = self.cluster.ray.wait([self.serving], timeout=0)
            if done:  # the actor ended before it joined: its error is the startup's
                self._error_tail = self._actor_error()
                self.mark_gone("its Ray actor ended before it joined the front end")
        return super().is_alive()

    def _actor_error(self) -> str:
        try:
            code = self.cluster.ray.get(self.serving, timeout=0)
        except Exception as error:
            return f"{type(error).__name__}: {error}"
        return f"the actor's engine exited with code {code}"

    def stop(self, timeout: float) -> None:
        """Wait for the hang-up like a remote rank, then remove the actor and its placement group."""
        super().stop(timeout)
        ray = self.cluster.ray
        if self.actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(self.actor, no_restart=True)
            self.actor = None
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.group)
            self.group = None
