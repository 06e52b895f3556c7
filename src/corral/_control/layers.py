"""Read-only workspace layers and memory images: deleting the ones nothing uses any more.

A memory image holds its layer; it goes first, when no snapshot and no sandbox names it, and
its layer then goes by the usual rule (no snapshot, sandbox or layer above stands on it)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..backends import IsolationBackend, LayerMounts, MemorySnapshots
from ..errors import CorralError
from .store import Store

__all__ = ["Layers"]

logger = logging.getLogger(__name__)


class Layers:
    """Garbage collection of layers (snapshots and sandboxes hold them; the store counts)."""

    def __init__(self, store: Store, backend: IsolationBackend, directory: Path, *,
                 backends: Callable[[str], IsolationBackend] | None = None,
                 loaded: Callable[[], list[IsolationBackend]] | None = None) -> None:
        self._store = store
        self._backend = backend  # layers live in the default tier's layered storage
        self._directory = directory
        # Memory images live with the tier that made them (recorded with each image).
        self._backends = backends or (lambda _isolation: backend)
        self._loaded = loaded or (lambda: [backend])  # the tiers whose leftovers to sweep
        # Held while deciding a layer is unused and while making a layer used, so a snapshot
        # deleted now cannot lose its layer to a sandbox being started from it.
        self.lock = threading.RLock()

    def collect(self) -> list[str]:
        """Delete the memory images and layers no snapshot or sandbox uses; return the
        layers' ids."""
        with self.lock:
            for image, isolation in self._store.unused_memory_images():
                try:
                    backend = self._backends(isolation)
                    if isinstance(backend, MemorySnapshots):
                        backend.remove_memory_image(image)
                except CorralError as exc:
                    # A tier that cannot load here (its host check fails) keeps the file; its
                    # own sweep removes it as a leftover once it runs. Deleting a snapshot
                    # must not fail for it.
                    logger.warning("memory image %s of the %s tier not removed: %s", image,
                                   isolation, exc)
            unused = self._store.unused_layers()
            others = [b for b in self._loaded() if b is not self._backend]
            for layer in unused:
                # Removal is idempotent, and a tier with layers of its own (the microVM tier's
                # qcow2 files) holds only the ones its sandboxes sealed: ask each loaded tier.
                self._backend.remove_layer(layer)
                for backend in others:
                    backend.remove_layer(layer)
            self.release_idle()
        return unused

    def release_idle(self) -> list[str]:
        """Unmount the layers no sandbox stands on (the snapshots' own): a stored snapshot
        holds no loop device or mount, however many there are. The next sandbox made from
        one mounts its layers again. Return the layers released."""
        if not isinstance(self._backend, LayerMounts):
            return []
        with self.lock:
            mounted = self._backend.mounted_layers()
            if not mounted:
                return []
            needed = self._store.mounted_layers_needed()
            return [layer for layer in mounted
                    if layer not in needed and self._backend.release_layer(layer)]

    def sweep(self) -> list[str]:
        """``collect``, and delete layer directories and memory images a crash left without
        a record."""
        removed = [f"layer {layer}" for layer in self.collect()]
        # An image is recorded before it is made, so one without a record is a leftover (the
        # tier is asked first: an image made meanwhile by another process is recorded by then).
        for backend in self._loaded():
            if isinstance(backend, MemorySnapshots):
                on_disk = backend.memory_image_ids()
                known_images = self._store.memory_image_ids()
                for image in on_disk:
                    if image not in known_images:
                        backend.remove_memory_image(image)
                        removed.append(f"memory image {image}")
        # A layer an open intent names is being made (or its maker's crash is not resolved
        # yet): never a leftover, whatever its age.
        known = self._store.layer_ids() | self._store.intent_layers()
        for layer in self._backend.layer_ids():
            # A seal in another process records its layer a moment after making it.
            if layer not in known and _age(self._directory / layer) > 60:
                self._backend.remove_layer(layer)
                removed.append(f"layer {layer}")
        for backend in self._loaded():
            age = getattr(backend, "layer_age", None)
            if backend is self._backend or age is None:
                continue
            for layer in backend.layer_ids():
                if layer not in known and age(layer) > 60:
                    backend.remove_layer(layer)
                    removed.append(f"layer {layer}")
        return removed


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except OSError:
        return 0.0
