def capacity_section(table):
    return {}
