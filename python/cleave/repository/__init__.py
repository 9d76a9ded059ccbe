"""Model repositories: many models and versions in one deployment (docs/repository.md)."""
