"""Kubernetes integration: Pod annotations, the admission webhook, the node agent.

- ``annotations``: ``agentzip.io/enable`` and ``agentzip.io/compression-level``, validated.
- ``webhook``: HTTPS AdmissionReview v1 mutating webhook (validates, records on the Pod).
- ``podcgroup``: Pod UID + QoS class -> cgroup path (systemd and cgroupfs drivers).
- ``nodeagent``: lists the node's Pods and keeps the scopes in step with the annotations.
"""
