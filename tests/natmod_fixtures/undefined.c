/* Refused: a call to a function no object defines (and no libc to fall back on). */
int fixture_missing_function(int x);

int fixture_call_missing(int x)
{
    return fixture_missing_function(x) + 1;
}
