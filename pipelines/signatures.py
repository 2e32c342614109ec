"""Pipelines whose signatures are made from their components' (the stage registry's): the lmforge pipeline's own,
a sub-pipeline of one step with its requests and Secrets, and a fan-out.

Why sub-pipelines: the KFP SDK passes a pipeline parameter into a ``ParallelFor`` or ``If`` DAG only when a task's
*inputs* use it, not when only its resources or Secrets do (the backend's driver then fails to resolve it:
``parent DAG does not have input parameter``), and it cannot pass a ``dsl.Collected`` (the cleaned shards, the
exact parts) into a ``ParallelFor`` at all (its compiler types it as a parameter and fails). So every step inside
such a DAG runs in a sub-pipeline whose inputs are the step's own and the parameters that place it, and every
fan-out over collected artifacts is a sub-pipeline whose input is a plain artifact list the loop can read. These
factories build both from the component's signature (itself generated from the stage registry), so that no port
is written twice.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, get_args, get_origin

import docstring_parser
from kfp import dsl
from kfp.dsl.base_component import BaseComponent
from kfp.dsl.types.type_annotations import OutputAnnotation

# The parameters every nested step takes besides its own inputs: its requests and the Secrets it reads.
NESTED_STEP_INPUTS = ("cpu_request", "memory_request", "s3_secret_name", "mlflow_secret_name")
RETRY = {"num_retries": 2, "backoff_duration": "30s"}

Placer = Callable[..., dsl.PipelineTask]


def _is_output(parameter: inspect.Parameter) -> bool:
    return get_origin(parameter.annotation) is not None and OutputAnnotation in get_args(parameter.annotation)


def _inputs_with_defaults(component: BaseComponent) -> list[inspect.Parameter]:
    """The component's inputs, in its signature's order."""
    parameters = inspect.signature(component.python_func).parameters.values()
    return [p for p in parameters if not _is_output(p)]


def _inputs(component: BaseComponent) -> list[inspect.Parameter]:
    """The component's inputs without defaults (a sub-pipeline passes every one)."""
    return [p.replace(default=inspect.Parameter.empty) for p in _inputs_with_defaults(component)]


def _output_annotation(component: BaseComponent, output: str) -> Any:
    """The type of the component's output ``output`` (``"Output"``: its single return value)."""
    signature = inspect.signature(component.python_func)
    if output == "Output":
        return signature.return_annotation
    return get_args(signature.parameters[output].annotation)[0]


def pipeline(
    name: str,
    doc: str,
    parameters: list[inspect.Parameter],
    body: Callable[[dict[str, Any]], Any],
    returns: Any = inspect.Signature.empty,
) -> BaseComponent:
    """A ``dsl.pipeline`` named ``name`` with signature ``parameters -> returns`` and docstring ``doc`` (KFP reads
    the parameters' help from its Args); ``body`` defines the DAG from the arguments by name."""
    signature = inspect.Signature(parameters, return_annotation=returns)

    def pipeline_func(*args: Any) -> Any:
        return body(signature.bind(*args).arguments)

    pipeline_func.__signature__ = signature  # type: ignore[attr-defined]
    pipeline_func.__name__ = name.replace("-", "_")
    pipeline_func.__doc__ = doc
    return dsl.pipeline(name=name)(pipeline_func)


def documented_parameters(
    doc: str, component: BaseComponent, own: dict[str, tuple[Any, Any]], defaults: dict[str, Any]
) -> list[inspect.Parameter]:
    """The parameters ``doc``'s Args name, in that order: ``component``'s inputs typed and defaulted as the component
    takes them (``defaults`` gives a default where it has none), the others from ``own`` (name → type, default).

    Raises:
        ValueError: an Args entry is neither, or an input of ``component`` has no Args entry.
    """
    inputs = {p.name: p for p in _inputs_with_defaults(component)}
    names = [param.arg_name for param in docstring_parser.parse(doc).params]
    if unknown := [n for n in names if n not in inputs and n not in own]:
        raise ValueError(f"documented but neither an input of {component.name} nor the pipeline's own: {unknown}")
    if undocumented := [n for n in inputs if n not in names]:
        raise ValueError(f"inputs of {component.name} without an Args entry: {undocumented}")
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    parameters = []
    for name in names:
        if name in own:
            annotation, default = own[name]
        else:
            annotation, default = inputs[name].annotation, defaults.get(name, inputs[name].default)
        parameters.append(inspect.Parameter(name, kind, annotation=annotation, default=default))
    return parameters


def nested_step(
    component: BaseComponent, name: str, display_name: str, output: str, place: Placer, *, cached: bool = True
) -> BaseComponent:
    """A sub-pipeline ``name`` running ``component`` once, retried, placed by ``place(task, *NESTED_STEP_INPUTS)``.

    Its inputs are the component's inputs and :data:`NESTED_STEP_INPUTS`; it returns the component's ``output``.
    """
    own = _inputs(component)
    extra = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=str) for n in NESTED_STEP_INPUTS]

    def body(arguments: dict[str, Any]) -> Any:
        task = component(**{p.name: arguments[p.name] for p in own})
        task.set_display_name(display_name).set_retry(**RETRY)
        if not cached:
            task.set_caching_options(False)
        place(task, *(arguments[n] for n in NESTED_STEP_INPUTS))
        return task.outputs[output]

    doc = f"``{component.name}`` with its requests and credentials, as a sub-pipeline (see {__name__})."
    return pipeline(name, doc, own + extra, body, _output_annotation(component, output))


def fan_out(step: BaseComponent, name: str, loop_input: str, items: str, loop_name: str) -> BaseComponent:
    """A sub-pipeline ``name`` running ``step`` for every element of its list input ``items``
    (``dsl.ParallelFor`` named ``loop_name``), each element as ``step``'s ``loop_input``; it returns their outputs
    collected. ``items`` stands where ``loop_input`` stands in ``step``'s signature."""
    signature = inspect.signature(step.pipeline_func)
    parameters = list(signature.parameters.values())
    position = [p.name for p in parameters].index(loop_input)
    parameters[position] = inspect.Parameter(items, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=list[int])

    def body(arguments: dict[str, Any]) -> Any:
        with dsl.ParallelFor(arguments[items], name=loop_name) as item:
            task = step(**{k: v for k, v in arguments.items() if k != items}, **{loop_input: item})
        return dsl.Collected(task.output)

    doc = f"``{step.name}`` for every element of ``{items}``, collected (a sub-pipeline: see {__name__})."
    return pipeline(name, doc, parameters, body, list[signature.return_annotation])
