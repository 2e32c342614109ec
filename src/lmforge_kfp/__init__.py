"""The Kubeflow Pipelines layer of lmforge: components, the DAG, and the commands that compile and run it.

Installed under this one package name from the repository's top-level folders: ``components/`` is
``lmforge_kfp.components`` (each stage's component, made from the registry; one folder per stage: compiled
``component.yaml``, generated README), ``pipelines/`` is ``lmforge_kfp.pipelines`` (the DAG, its compiled
YAML, local and remote runs). This package depends on the ``lmforge`` library; the library never imports it. Its
commands (``run``, ``compile``, ``images``, ``submit``, ``schedule``, ``runs``) plug into the ``lmforge``
CLI through the ``lmforge.commands`` entry point group (:mod:`lmforge_kfp.commands`).
"""
