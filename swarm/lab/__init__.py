"""A network lab in the kernel: namespaces, veth links shaped by tbf, home NATs.

:mod:`swarm.lab.plan` lays a scenario out (no root needed); :mod:`swarm.lab.kernel`
builds it with ``ip``, ``tc`` and ``iptables``, runs processes inside its namespaces and
tears it all down; :mod:`swarm.lab.runner` is ``swarm lab run``.
"""
