"""Analytic predictors: no runtime module imports this package."""
