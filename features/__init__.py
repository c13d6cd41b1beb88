"""The one definition of per-step draft features, used by data collection and by the runtime."""

from .schema import (FEATURE_GROUPS, FEATURES, SCHEMA_VERSION, Feature, feature_index,
                     schema_dict)
from .compute import RoundContext, draft_features, root_statistics

__all__ = ["FEATURE_GROUPS", "FEATURES", "SCHEMA_VERSION", "Feature", "feature_index",
           "schema_dict", "RoundContext", "draft_features", "root_statistics"]
