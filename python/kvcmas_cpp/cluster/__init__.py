"""kvcmas on a Ray cluster (the optional extra `kvcmas_cpp[cluster]`): `kvcmas cluster up|down|status`.

routing.py (no Ray): the routing key and rendezvous hashing over stable replica ranks. serve_app.py (imports Ray):
the engine deployments and the ingress. cli.py: the commands. Nothing here is imported by the single-node package;
see docs/cluster.md.
"""
