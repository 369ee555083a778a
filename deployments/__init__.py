"""Ray Serve deployments (ingress, engine servers, coordinator); see docs/architecture.md."""
