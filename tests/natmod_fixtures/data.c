/* Refused: an initialised writable global lands in .data, which a native .mpy cannot carry. */
int fixture_table[4] = {1, 2, 3, 4};

int fixture_data_get(int i)
{
    return fixture_table[i & 3];
}
