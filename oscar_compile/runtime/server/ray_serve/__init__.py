"""Many engine replicas behind one OpenAI endpoint, on Ray Serve (``oscar-compile serve --replicas N``).

Why Ray Serve and not our own: it places replicas on the nodes of a cluster with their GPUs as
resources, restarts failed ones, autoscales, and lets a deployment plug in its own request router.
What is ours is small and lives here, one concern a module:

- ``replica.py``: the deployment that holds one engine (today's ``AsyncEngine``);
- ``limits.py``: the engine's limits, sent once to the ingress, so that it checks each request
  with the engine's own code before any replica sees it;
- ``remote_engine.py``: what the ingress's app calls in place of an ``AsyncEngine``: each request
  streamed from a replica through a ``DeploymentHandle``, retried when its replica died before
  answering;
- ``prefix_keys.py`` and ``router.py``: prefix-affinity routing on the engine's snapshot boundaries;
- ``metrics.py``: one ``/metrics`` for the application;
- ``ingress.py``: the ingress deployment (today's FastAPI app) and the application graph.

Nothing here imports ``ray`` at package import: the default install has no Ray (the ``[ray]`` extra).
"""
