"""Register ``mapl_llama`` with transformers' auto classes when transformers is imported.

``import mapl_swarm`` must stay light (the wire package runs without torch, and a config mistake is
answered before torch loads), so it does not import transformers. Instead it calls
:func:`register_when_imported`: at once if transformers is already loaded, else after transformers'
own import has run, through a one-shot import hook. Either way ``AutoConfig`` and
``AutoModelForCausalLM`` know ``mapl_llama`` before user code can ask for them.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys

log = logging.getLogger(__name__)

__all__ = ["register", "register_when_imported"]

_done = False


def register() -> None:
    """Register MaplConfig / MaplForCausalLM with AutoConfig / AutoModelForCausalLM (once)."""
    global _done
    if _done:
        return
    _done = True
    from transformers import AutoConfig, AutoModelForCausalLM

    # a dynamic import: the package root stays torch-free for the import-graph rules
    modeling = importlib.import_module("mapl_swarm.hf.modeling")
    AutoConfig.register(modeling.MODEL_TYPE, modeling.MaplConfig, exist_ok=True)
    AutoModelForCausalLM.register(modeling.MaplConfig, modeling.MaplForCausalLM, exist_ok=True)


class _AfterTransformers(importlib.abc.MetaPathFinder):
    """Finds ``transformers`` with the other finders and registers once its module has run."""

    def find_spec(self, name, path, target=None):
        if name != "transformers":
            return None
        sys.meta_path.remove(self)  # one shot; also keeps find_spec below from finding us again
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            try:
                register()
            except Exception as exc:  # noqa: BLE001 - never break the user's import of transformers
                log.warning("mapl_llama not registered with transformers' auto classes: %s", exc)

        spec.loader.exec_module = exec_module
        return spec


def register_when_imported() -> None:
    """:func:`register` now if transformers is loaded, else right after it is."""
    if "transformers" in sys.modules:
        register()
    elif not any(isinstance(f, _AfterTransformers) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterTransformers())
