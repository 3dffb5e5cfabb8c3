"""autopar planner: trace -> cost -> search -> partition plan. ``plan_model`` is the public Python entry."""


def plan_model(model, cluster, **kwargs):
    """Plan ``model`` on ``cluster``: see ``planner.search.driver.plan_model`` (imported on first call)."""
    from planner.search.driver import plan_model as _plan_model

    return _plan_model(model, cluster, **kwargs)


__all__ = ["plan_model"]
