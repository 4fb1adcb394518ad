"""After training: ``export`` (adapter or full model), ``merge`` (+ ``verify``), ``card``, ``hub`` (push).

Imports ``config``, ``model`` and ``files``; never ``xla`` or ``train``: merging and checking run on
the host CPU.
"""
