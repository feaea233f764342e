/* Debian's librdkafka-dev: the client API and the in-process mock cluster. */
#include <librdkafka/rdkafka.h>
#include <librdkafka/rdkafka_mock.h>
