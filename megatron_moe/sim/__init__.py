"""Cluster simulator (issue #13, docs/simulator.md): predicted iteration time of a model on a cluster
and layout for several option combinations, replaying a recorded or synthetic routing trace. The
schedules', balancers' and Parm's decisions come from the training code; bytes and rows per rank
are exact; time is modelled from a hardware profile (`tools/simulate.py`)."""
