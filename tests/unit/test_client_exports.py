"""The public surface of the SDK: `exgrpo_client.__all__` is sorted and complete."""

from __future__ import annotations

import exgrpo_client
from exgrpo_client import errors


def test_all_is_sorted_and_unique() -> None:
    assert exgrpo_client.__all__ == sorted(exgrpo_client.__all__)
    assert len(set(exgrpo_client.__all__)) == len(exgrpo_client.__all__)


def test_every_exported_name_resolves() -> None:
    for name in exgrpo_client.__all__:
        assert getattr(exgrpo_client, name) is not None, name


def test_public_names_that_are_not_exported() -> None:
    """Every public attribute of the package is in `__all__` (submodules aside)."""
    submodules = {"errors", "exports", "frames", "io", "logs", "schemas"}
    public = {n for n in vars(exgrpo_client) if not n.startswith("_")} - submodules
    assert public == set(exgrpo_client.__all__)


def test_every_error_class_is_exported_and_derives_from_the_base() -> None:
    classes = {
        name: obj
        for name, obj in vars(errors).items()
        if isinstance(obj, type) and issubclass(obj, Exception) and obj.__module__ == errors.__name__
    }
    assert set(classes) <= set(exgrpo_client.__all__)
    for cls in classes.values():
        assert issubclass(cls, errors.ExgrpoError)


def test_sync_and_async_clients_offer_the_same_methods() -> None:
    """The two clients differ only in I/O: same names, same parameters, one blocking, one awaited."""
    import inspect

    def methods(cls: type) -> dict[str, inspect.Signature]:
        return {
            name: inspect.signature(fn)
            for name, fn in vars(cls).items()
            if callable(fn) and not name.startswith("_") and name not in ("close", "aclose")
        }

    sync, asynchronous = methods(exgrpo_client.Client), methods(exgrpo_client.AsyncClient)
    assert sync.keys() == asynchronous.keys()
    for name, signature in sync.items():
        assert list(signature.parameters) == list(asynchronous[name].parameters), name
        for param in signature.parameters.values():
            other = asynchronous[name].parameters[param.name]
            assert (param.kind, param.default) == (other.kind, other.default), f"{name}({param.name})"
        method = getattr(exgrpo_client.AsyncClient, name)
        assert inspect.iscoroutinefunction(method) or inspect.isasyncgenfunction(method), name
