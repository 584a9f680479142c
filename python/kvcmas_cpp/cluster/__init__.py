"""kvcmas on a Ray cluster (the optional extra `kvcmas_cpp[cluster]`): `kvcmas cluster up|down|status`.

routing.py (no Ray): the routing key and rendezvous hashing over stable replica ranks. config.py (no Ray): the Serve
config, one application per engine rank and one for the ingress. serve_app.py (imports Ray): the engine and ingress
applications. cli.py: the commands. Nothing here is imported by the single-node package;
see docs/cluster.md.
"""
