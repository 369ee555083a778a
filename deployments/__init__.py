"""Ray Serve deployments (ingress, engine servers, coordinator); see ARCHITECTURE.md."""
