"""Fleet operation: the Prometheus exporter, the systemd units and their installer
(`systemd`), and the Kubernetes admission webhook and node agent (`k8s`)."""
