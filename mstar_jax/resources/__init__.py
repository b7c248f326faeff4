"""Resources: specs a model declares, steps an engine declares, and the resources that serve them."""
