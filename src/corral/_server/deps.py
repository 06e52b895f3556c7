# temporary: removed when _ui/_control import corral._http directly (issue 39)
from .._http.deps import ManagerDep, TenantDep

__all__ = ["ManagerDep", "TenantDep"]
